"""The per-run bearer token and per-launch nonce that every listener of a run checks.

One run (one flow run, one ``grpo train``) generates one random token; it reaches the processes the
run starts through their environment (``GRPO_RUN_TOKEN``), never through a command line, a config
file or a log line. Every listener the run starts answers only requests carrying
``Authorization: Bearer <token>`` (HTTP) or the same ``authorization`` call header (Arrow Flight);
anything else gets 401 (Flight: ``FlightUnauthenticatedError``) and changes nothing.

Each server launch also gets a random nonce (``GRPO_RUN_NONCE``, not secret). Before the launcher sends the
token to a port it checks who answers there without handing the token over: it sends a fresh random challenge
to the unauthenticated ``GET /grpo/identity?challenge=...`` (``grpo_core.serving.protocol.IDENTITY_PATH``, where
the HTTP protocol's paths live) and accepts the server only when the answer holds
this launch's nonce and ``HMAC-SHA256(K, challenge ‖ 0 ‖ nonce)`` with ``K = HMAC-SHA256(token, "grpo-flow
identity v1")`` (:func:`identity_proof`), compared in constant time. Another run's server (other token), a
server of an earlier launch (same token, other nonce) or any other program on the port fails the check and is
never sent the token. The route is an HMAC oracle under a key derived for this purpose only, so its answers
prove nothing anywhere else and reveal nothing of the token. It does not stop a process that relays the
challenge to our own server and back (a man in the middle on the same host): only TLS with a pinned certificate
would; every listener binds loopback by default.

A server that cannot answer the challenge (Prefect's API server) is checked by the socket instead
(:func:`listener_owned`): every socket listening on its port must belong to the process started (or its
descendants), read from ``/proc``, before the credential is sent.

Three keys derive from the token, each accepted only where its role needs it (:func:`derive_key`,
``HMAC-SHA256(secret, "grpo-flow key v1 " ‖ role)``): the **control** key (``GRPO_CONTROL_KEY``, from the token:
every route of the generation servers and the router — pause, resume, weight and LoRA updates, ``/grpo/stale`` —
and generation), the **inference** key (``GRPO_INFERENCE_KEY``, from the control key: the generation routes only,
``grpo_core.serving.protocol.INFERENCE_PATHS``; 403 elsewhere) and the trainer **membership** key
(``GRPO_MEMBER_KEY``, from the token: the rollout's Flight server and the trainer ranks' membership check; no HTTP
route). The flow holds the token; each child gets only its role's keys (servers and the router: control; rollout
and trainer: control and membership); a listener given a key also accepts the secret it derives from (the token
opens every listener, as before). ``python -m grpo_core.security.auth ROLE...`` prints the keys of ``$GRPO_RUN_TOKEN``
for the hosts of a multi-host run (``docs/across-hosts.md``).

Only the standard library (and ``grpo_core.errors``) is imported here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from collections.abc import Mapping

from grpo_core.errors import PortInUseError

TOKEN_ENV = "GRPO_RUN_TOKEN"
"""Environment variable holding the run's bearer token (security-relevant: never log it)."""
NONCE_ENV = "GRPO_RUN_NONCE"
"""Environment variable holding one server launch's nonce (not secret)."""
_IDENTITY_LABEL = b"grpo-flow identity v1"
_CHALLENGE_HEX = range(32, 129)  # accepted challenge lengths (hex digits): 128 to 512 bits


#: Fewest characters of a token that several trainer hosts share (``train.nnodes`` > 1).
MIN_SHARED_TOKEN_CHARS = 16


def token_problem(value: str) -> str | None:
    """Why ``value`` cannot be a bearer token (None when it can): it travels in HTTP ``Authorization`` headers,
    which take printable ASCII only, and a blank one would turn authentication off."""
    if not value.strip():
        return "it is empty or blank"
    bad = sorted({c for c in value if not "!" <= c <= "~"})
    if bad:
        return (
            f"it holds {len(bad)} character(s) an HTTP header cannot carry (spaces, non-ASCII or control "
            "characters); use printable ASCII, e.g. the output of `openssl rand -hex 32`"
        )
    return None


def new_token() -> str:
    """A fresh random token: 32 bytes from ``secrets`` (256 bits), URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def run_token(env: Mapping[str, str] | None = None) -> str | None:
    """The run's token from ``GRPO_RUN_TOKEN`` in ``env`` (default: this process's environment), or None."""
    value = (os.environ if env is None else env).get(TOKEN_ENV, "")
    return value or None


def ensure_run_token() -> str:
    """The run's token, generated and put in this process's environment (for its children) when missing."""
    token = run_token()
    if token is None:
        token = new_token()
        os.environ[TOKEN_ENV] = token
    return token


TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV = "GRPO_TLS_CERT_FILE", "GRPO_TLS_KEY_FILE", "GRPO_TLS_CA_FILE"
"""Where the run's rollout and trainer processes read ``tls.cert_file``, ``tls.key_file`` and ``tls.ca_file``
(paths, not secrets; set by :func:`grpo_core.run.prepare.run_child_env`)."""


def tls_env(tls: object) -> dict[str, str]:
    """The environment that hands a ``TLSConfig``'s files to the run's processes (empty when TLS is off)."""
    names = ((TLS_CERT_ENV, "cert_file"), (TLS_KEY_ENV, "key_file"), (TLS_CA_ENV, "ca_file"))
    return {env: str(getattr(tls, field)) for env, field in names if getattr(tls, field, None) is not None}


def tls_files(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None, str | None]:
    """``(cert_file, key_file, ca_file)`` from ``env`` (default this process's environment); None where unset."""
    env = os.environ if env is None else env
    return env.get(TLS_CERT_ENV) or None, env.get(TLS_KEY_ENV) or None, env.get(TLS_CA_ENV) or None


ROLE_INFERENCE, ROLE_CONTROL, ROLE_MEMBER = "inference", "control", "member"
"""The three roles a key of the run grants (``docs/security.md``, "Keys and roles")."""
INFERENCE_KEY_ENV = "GRPO_INFERENCE_KEY"
"""Environment variable of the inference key: the generation routes of the servers and the router only."""
CONTROL_KEY_ENV = "GRPO_CONTROL_KEY"
"""Environment variable of the control key: every route of the servers and the router (pause, resume, weight and
LoRA updates, ``/grpo/stale``, ``/metrics``, … and generation); what the servers themselves hold."""
MEMBER_KEY_ENV = "GRPO_MEMBER_KEY"
"""Environment variable of the trainer membership key: the rollout's Flight server and the trainer ranks'
membership check (``grpo_core.train.distributed.check_members``); no HTTP route takes it."""
ROLE_KEY_ENV = {ROLE_INFERENCE: INFERENCE_KEY_ENV, ROLE_CONTROL: CONTROL_KEY_ENV, ROLE_MEMBER: MEMBER_KEY_ENV}
_KEY_LABEL = b"grpo-flow key v1 "


def derive_key(secret: str, role: str) -> str:
    """The key of ``role`` derived from ``secret``: ``HMAC-SHA256(secret, "grpo-flow key v1 " ‖ role)``, hex (64
    printable characters, an HTTP header value).

    The control and membership keys derive from the run's token; the inference key derives from the control key,
    so a holder of the control key (a server) can check the inference key without holding the run's token, and no
    key yields the run's token or a key of another branch (HMAC is a pseudo-random function, RFC 2104).

    Raises:
        ValueError: ``role`` is none of ``inference``, ``control``, ``member``.
    """
    if role not in ROLE_KEY_ENV:
        raise ValueError(f"unknown key role {role!r}: one of {', '.join(ROLE_KEY_ENV)}")
    return hmac.new(secret.encode(), _KEY_LABEL + role.encode(), hashlib.sha256).hexdigest()


def role_key(role: str, env: Mapping[str, str] | None = None) -> str | None:
    """This process's key of ``role`` (None when it has none).

    From ``env`` (default this process's environment): the role's own variable (``GRPO_INFERENCE_KEY``,
    ``GRPO_CONTROL_KEY``, ``GRPO_MEMBER_KEY``) when set, else derived (:func:`derive_key`) from the run's token
    ``GRPO_RUN_TOKEN`` (the flow and a single-host run hold it and need nothing else), the inference key also from
    ``GRPO_CONTROL_KEY``.

    Raises:
        ValueError: ``role`` is unknown.
    """
    env = os.environ if env is None else env
    if role not in ROLE_KEY_ENV:
        raise ValueError(f"unknown key role {role!r}: one of {', '.join(ROLE_KEY_ENV)}")
    if own := env.get(ROLE_KEY_ENV[role], ""):
        return own
    if role == ROLE_INFERENCE:
        control = role_key(ROLE_CONTROL, env)
        return derive_key(control, ROLE_INFERENCE) if control else None
    token = run_token(env)
    return derive_key(token, role) if token else None


def role_env(token: str, *roles: str) -> dict[str, str]:
    """The environment that hands a child the keys of ``roles`` derived from the run's ``token`` (never the token).

    Raises:
        ValueError: a role is unknown.
    """
    control = derive_key(token, ROLE_CONTROL)
    keys = {
        ROLE_CONTROL: control,
        ROLE_MEMBER: derive_key(token, ROLE_MEMBER),
        ROLE_INFERENCE: derive_key(control, ROLE_INFERENCE),
    }
    for role in roles:
        if role not in keys:
            raise ValueError(f"unknown key role {role!r}: one of {', '.join(ROLE_KEY_ENV)}")
    return {ROLE_KEY_ENV[role]: keys[role] for role in roles}


def without_keys(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less the run's token and every role key (a child then gets only the keys added back for it)."""
    drop = {TOKEN_ENV, *ROLE_KEY_ENV.values()}
    return {name: value for name, value in env.items() if name not in drop}


def listener_keys(secret: str) -> tuple[list[str], list[str]]:
    """``(control keys, inference keys)`` an HTTP listener given ``secret`` accepts.

    ``secret`` is its control key, or the run's token (which derives it): the listener accepts ``secret`` and the
    control key derived from it for control, and the inference keys derived from those for inference. So a server
    given either serves the clients of both (a client derives its control key from the run's token,
    :func:`role_key`); the extra keys are ones only a holder of ``secret`` can compute.
    """
    control = [secret, derive_key(secret, ROLE_CONTROL)]
    return control, [derive_key(key, ROLE_INFERENCE) for key in control]


def bearer_role(header_value: str | None, control: list[str], inference: list[str]) -> str | None:
    """The role an ``Authorization`` header's key grants on an HTTP listener: ``control``, ``inference``, or None
    (no key, or another: 401). Every comparison is constant-time.

    A key passes as control when it is one of ``control``, or the secret one of them derives from
    (:func:`derive_key`: the run's token opens a server that holds only its control key, which serves as the
    token's verifier, so the server need not hold the token); as inference when it is one of ``inference``.

    Args:
        header_value: the request's ``Authorization`` header (None when absent).
        control: the keys that grant control (:func:`listener_keys`).
        inference: the keys that grant inference only.
    """
    if not header_value:
        return None
    scheme, _, given = header_value.partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        return None
    derived = derive_key(given, ROLE_CONTROL).encode()
    if any(
        hmac.compare_digest(given.encode(), k.encode()) or hmac.compare_digest(derived, k.encode()) for k in control
    ):
        return ROLE_CONTROL
    if any(hmac.compare_digest(given.encode(), k.encode()) for k in inference):
        return ROLE_INFERENCE
    return None


def member_authorized(header_value: str | None, key: str) -> bool:
    """Whether an ``authorization`` header holds the trainer membership key ``key``, or the secret it derives from
    (the run's token, :func:`derive_key`), or is the key derived from ``key`` when ``key`` is itself the run's
    token (constant-time comparisons)."""
    if not header_value or not key:
        return False
    scheme, _, given = header_value.partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        return False
    keys = (key.encode(), derive_key(key, ROLE_MEMBER).encode())
    derived = derive_key(given, ROLE_MEMBER).encode()
    return any(hmac.compare_digest(given.encode(), k) or hmac.compare_digest(derived, k) for k in keys)


def bearer_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or ``{}`` without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def new_challenge() -> str:
    """A fresh identity challenge: 16 random bytes from ``secrets``, as 32 hex digits."""
    return secrets.token_hex(16)


def identity_proof(token: str, nonce: str, challenge: str) -> str:
    """The answer of a server holding ``token`` to ``challenge`` at launch ``nonce`` (hex, 64 digits).

    ``HMAC-SHA256(K, challenge ‖ 0x00 ‖ nonce)`` with ``K = HMAC-SHA256(token, "grpo-flow identity v1")``: the key
    derived for identity proofs only, so no answer is a valid tag of anything else the run MACs with its token
    (the trainer ranks' membership check, ``grpo_core.train.distributed``). RFC 2104 HMAC; a PRF, so answers to
    chosen challenges reveal nothing of the token.
    """
    key = hmac.new(token.encode(), _IDENTITY_LABEL, hashlib.sha256).digest()
    return hmac.new(key, challenge.encode() + b"\x00" + nonce.encode(), hashlib.sha256).hexdigest()


def identity_answer(query_string: bytes | str, token: str, nonce: str) -> tuple[int, dict[str, str]]:
    """``(status, JSON body)`` of ``GET /grpo/identity`` on a listener holding ``token``, launched with ``nonce``.

    Args:
        query_string: the request's raw query string (``challenge=<32 to 128 hex digits>``).
        token: the listener's token.
        nonce: its launch's nonce ('' = none).

    Returns:
        ``(200, {"nonce", "proof"})``, or ``(400, {"error"})`` for a missing or malformed challenge.
    """
    from urllib.parse import parse_qs

    raw = query_string.decode("latin-1") if isinstance(query_string, bytes) else query_string
    given = parse_qs(raw).get("challenge", [""])[0]
    if len(given) not in _CHALLENGE_HEX or any(c not in "0123456789abcdef" for c in given):
        return 400, {"error": "challenge must be 32 to 128 lowercase hex digits (a fresh random value per check)"}
    return 200, {"nonce": nonce, "proof": identity_proof(token, nonce, given)}


def identity_problem(status: int, body: object, token: str, nonce: str, challenge: str) -> str | None:
    """Why an answer to ``GET /grpo/identity?challenge=...`` is not our launch's (None when it is).

    Args:
        status: the answer's HTTP status.
        body: its decoded JSON body (anything else counts as no proof).
        token: the server's control key, or the run's token (never sent: only compared against); a proof under
            the control key derived from the token passes too, as the servers the run starts hold only that key.
        nonce: the launch's nonce.
        challenge: the challenge sent.
    """
    if status != 200:
        return f"it has no identity route (HTTP {status})"
    given_nonce = body.get("nonce") if isinstance(body, dict) else None
    proof = body.get("proof") if isinstance(body, dict) else None
    if not isinstance(given_nonce, str) or not isinstance(proof, str):
        return "it does not prove that it holds this run's token"
    keys = (token, derive_key(token, ROLE_CONTROL))
    if not any(hmac.compare_digest(proof.encode(), identity_proof(k, given_nonce, challenge).encode()) for k in keys):
        return "it does not prove that it holds this run's token"
    return (
        None if hmac.compare_digest(given_nonce.encode(), nonce.encode()) else "it does not report this launch's nonce"
    )


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP ``port`` (IPv4 and IPv6) in this network namespace; None without ``/proc``."""
    found, readable = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                lines = rows.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                found.add(fields[9])
    return found if readable else None


def _process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants, read from ``/proc/<pid>/stat``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def listener_owned(port: int, pid: int) -> str | None:
    """Why TCP ``port`` is not served by process ``pid`` alone (None when it is): every socket listening on the
    port must be held by ``pid`` or one of its descendants (``/proc/net/tcp*`` and ``/proc/<pid>/fd``), so no
    other process (not one sharing the port through ``SO_REUSEPORT`` either) can be handed a credential sent there.

    Linux only; processes of the same user (their ``fd`` folders are readable).
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return "/proc/net/tcp cannot be read, so who listens there cannot be checked"
    if not inodes:
        return "nothing listens on it"
    held: set[str] = set()
    for member in _process_tree(pid):
        try:
            fds = os.listdir(f"/proc/{member}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{member}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                held.add(link[8:-1])
    foreign = inodes - held
    return f"{len(foreign)} of its {len(inodes)} listening socket(s) belong to another process" if foreign else None


def check_port_free(host: str, port: int, field_name: str = "server.port") -> None:
    """Raise ``PortInUseError`` when ``host:port`` cannot be bound because another process listens there.

    Raises:
        PortInUseError: the port is taken (the message names ``field_name`` and the fix).
    """
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed socket in TIME_WAIT is no owner
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"{host}:{port} is already in use ({exc.strerror or exc}): another process (another "
                f"run's server?) listens there and this run will not attach to it; stop it, or set "
                f"{field_name} to a free port (0 = pick one)"
            ) from None


def main(argv: list[str] | None = None) -> int:
    """``python -m grpo_core.security.auth ROLE...``: print ``export NAME=KEY`` for each role's key (``inference``,
    ``control``, ``member``) derived from ``$GRPO_RUN_TOKEN`` (read from the environment, never an argument), for the
    hosts of a multi-host run; returns the exit status (0 for ``--help``; 2: an unknown role, no token, or a token
    :func:`token_problem` refuses or shorter than :data:`MIN_SHARED_TOKEN_CHARS`, each named)."""
    import sys

    roles = sys.argv[1:] if argv is None else argv
    usage = (
        f"usage: {TOKEN_ENV}=... python -m grpo_core.security.auth ROLE... (ROLE: {', '.join(ROLE_KEY_ENV)}); "
        "prints each role's key of the run's token as an export line\n"
    )
    if roles and roles[0] in ("-h", "--help"):
        sys.stdout.write(usage)
        return 0
    token, problem = run_token(), None
    unknown = [role for role in roles if role not in ROLE_KEY_ENV]
    if not roles:
        problem = "no ROLE given"
    elif unknown:
        problem = f"unknown role {unknown[0]!r}"
    elif not token:
        problem = f"{TOKEN_ENV} is not set"
    elif token_problem(token):
        problem = f"{TOKEN_ENV}: {token_problem(token)}"
    elif len(token) < MIN_SHARED_TOKEN_CHARS:
        problem = (
            f"{TOKEN_ENV} has {len(token)} characters (fewer than {MIN_SHARED_TOKEN_CHARS}): export a long random "
            f"one, e.g. {TOKEN_ENV}=$(openssl rand -hex 32)"
        )
    if problem is not None:
        sys.stderr.write(usage + f"error: {problem}\n")
        return 2
    assert token is not None
    sys.stdout.write("".join(f"export {name}={key}\n" for name, key in role_env(token, *roles).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
