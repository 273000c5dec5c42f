"""Prefect's local API for ``grpo train`` and ``grpo deploy``: its home folder and database, checked first.

Left to itself, Prefect creates ``PREFECT_HOME`` without its parents (only a warning when that
fails), and its temporary API server then retries an unopenable SQLite database every few seconds
until its start-up timeout. Here the home folder is created with its parents and the database is
opened once before Prefect starts anything, and the temporary server is started up front and
watched, so any failure ends the command within seconds with an error naming the path and the cause.

A server started here requires a basic-auth string (``PREFECT_SERVER_API_AUTH_STRING``; its clients send
``PREFECT_API_AUTH_STRING``): the environment's, or a fresh random one; and it is used only once it proves to
be the process started here (:func:`verify_own_server`: it holds every socket listening on the port), never
sent to another server that answers on its port.

The temporary server runs in its own session, owned by this process (``grpo_core.run.lifeline``): a Ctrl-C in the
terminal (SIGINT to the foreground process group) reaches the flow, which records its crash on the still-running
server and stops its children, and Prefect stops the server at exit; were the server in the flow's group, it
would die first and the flow would retry its final state on a dead API for minutes. A SIGKILLed command takes
the server with it within a second.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_core.errors import ConfigError, GrpoError
from grpo_core.run.stores import check_sqlite, ensure_dir, sqlite_path
from grpo_core.security.auth import new_token

logger = logging.getLogger(__name__)

# Settings that name Prefect's database (the server's own name first; the API_ alias is older).
DATABASE_SETTINGS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


# Prefect's basic-auth settings: the server's and its clients' (the same "user:password" string).
AUTH_SERVER_ENV, AUTH_CLIENT_ENV = "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"


class PrefectApiError(GrpoError):
    """Prefect's API could not be started or reached (the message names the server, path and cause)."""


def local_auth_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Auth settings of a Prefect server this command starts, for it and its clients.

    The environment's ``PREFECT_SERVER_API_AUTH_STRING`` (or ``PREFECT_API_AUTH_STRING``) when set, else a
    fresh ``grpo:<random>`` (``grpo_core.security.auth.new_token``) for this server only. Security-relevant: never
    log it.
    """
    env = os.environ if env is None else env
    auth = env.get(AUTH_SERVER_ENV) or env.get(AUTH_CLIENT_ENV) or f"grpo:{new_token()}"
    return {AUTH_SERVER_ENV: auth, AUTH_CLIENT_ENV: auth}


def verify_own_server(api_url: str, auth_string: str, process: Any, what: str) -> None:
    """Raise ``PrefectApiError`` unless ``api_url`` is served by the Prefect server ``process`` we started.

    Ours is alive and holds every socket listening on the URL's port (it or its descendants:
    ``grpo_core.security.auth.listener_owned``, read from ``/proc``); only then is the auth string sent, and ours
    refuses a request without it (401) and accepts it with it. Another server on the port is never sent the auth
    string: Prefect's server cannot answer a challenge, so the socket's owner is what proves identity.

    Args:
        api_url: ``http://host:port/api``.
        auth_string: the ``user:password`` the server was started with.
        process: its ``subprocess.Popen``.
        what: the server's name in the message (e.g. ``grpo deploy --port 4200``).
    """
    import base64
    from urllib.parse import urlsplit

    import httpx

    from grpo_core.security.auth import listener_owned

    if process.poll() is not None:
        raise PrefectApiError(f"the Prefect server of {what} exited with code {process.returncode}")
    port = urlsplit(api_url).port or 80
    problem = listener_owned(port, process.pid)
    if problem is not None:
        raise PrefectApiError(
            f"{api_url} is not served by the Prefect server {what} started (port {port}: {problem}); its auth "
            "string was not sent; stop that server or use another port"
        )
    probe = api_url.rstrip("/") + "/admin/version"
    basic = {"Authorization": "Basic " + base64.b64encode(auth_string.encode()).decode()}
    try:
        anonymous = httpx.get(probe, timeout=10).status_code
        authed = httpx.get(probe, headers=basic, timeout=10).status_code if anonymous == 401 else None
    except httpx.HTTPError as exc:
        raise PrefectApiError(f"the Prefect server of {what} at {api_url} does not answer: {exc}") from None
    if anonymous != 401 or authed != 200:
        raise PrefectApiError(
            f"{api_url} is answered by a Prefect server {what} did not start (without credentials: "
            f"HTTP {anonymous}, with this server's: {'not sent' if authed is None else f'HTTP {authed}'}); stop "
            "that server or use another port"
        )


def database_path(home: Path, env: Mapping[str, str]) -> Path | None:
    """The SQLite file Prefect's server will open: the configured URL's file, else ``<home>/prefect.db``.

    Returns None when the configured database is not SQLite (a PostgreSQL server is not checked here).
    """
    for key in DATABASE_SETTINGS:
        if env.get(key):
            return sqlite_path(env[key])
    return Path(home) / "prefect.db"


def prepare_home(home: Path, env: Mapping[str, str] | None = None) -> Path:
    """Create Prefect's home folder (with parents) and open its SQLite database once: the folder 0700, the
    database 0600 (Prefect's database holds every run's parameters and log lines).

    Args:
        home: the ``PREFECT_HOME`` folder.
        env: environment the server will see (default: this process's).

    Returns:
        ``home``, resolved.

    Raises:
        ConfigError: the folder or the database cannot be created or opened (path and cause named).
    """
    env = os.environ if env is None else env
    home = ensure_dir(Path(home), "PREFECT_HOME (Prefect's home folder)", private=True)
    db = database_path(home, env)
    if db is not None:
        check_sqlite(
            db,
            "Prefect's database (PREFECT_HOME/prefect.db or PREFECT_SERVER_DATABASE_CONNECTION_URL)",
            private=db.parent == home,
        )
    else:
        _check_database_server(next(env[k] for k in DATABASE_SETTINGS if env.get(k)))
    return home


def _check_database_server(url: str, timeout_s: float = 5.0) -> None:
    """A database server URL (PostgreSQL) must at least accept a TCP connection."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", parts.port or 5432
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"Prefect's database server {host}:{port} (PREFECT_SERVER_DATABASE_CONNECTION_URL) does not "
            f"accept connections: {exc.strerror or exc}; start it or fix the URL"
        ) from None


def check_api_url(url: str, timeout_s: float = 10.0) -> None:
    """Raise ``PrefectApiError`` unless the Prefect server at ``url`` (``PREFECT_API_URL``) answers ``/health``."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=timeout_s).raise_for_status()
    except httpx.HTTPError as exc:
        raise PrefectApiError(
            f"PREFECT_API_URL={url}: the Prefect server does not answer /health "
            f"({type(exc).__name__}: {exc}); start it (grpo deploy) or unset PREFECT_API_URL "
            "to use a temporary local server"
        ) from None


def _own_auth() -> str | None:
    """Put an auth string for the temporary server and this process's client in the environment (before Prefect
    is imported: its settings are read once); None when Prefect was imported already (the server runs without)."""
    if "prefect" in sys.modules and not os.environ.get(AUTH_CLIENT_ENV):
        logger.warning(
            "Prefect was imported before its temporary API server started: the server runs without an "
            "auth string (set %s and %s to require one)",
            AUTH_SERVER_ENV,
            AUTH_CLIENT_ENV,
        )
        return None
    os.environ.update(local_auth_env())
    return os.environ[AUTH_SERVER_ENV]


@functools.cache
def _owned_server_class() -> type:
    """Prefect's ``SubprocessASGIServer`` whose process starts in its own session under ``python -m
    grpo_core.run.lifeline`` (see the module docstring); built on first use (Prefect's import is slow). Should Prefect's
    command ever not be ``python -m uvicorn …``, the server starts as Prefect starts it, with a warning."""
    import types

    import prefect.server.api.server as prefect_server

    from grpo_core.run.children import start_child
    from grpo_core.run.lifeline import owner_env

    def popen(args: list[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
        args = list(args)
        if args[1:3] != ["-m", "uvicorn"]:
            logger.warning(
                "Prefect's temporary API server command is not `python -m uvicorn …` (%s): started in this "
                "command's process group, so a Ctrl-C reaches it too",
                args[:3],
            )
            return subprocess.Popen(args, env=env, **kwargs)
        env = {**(os.environ if env is None else env), **owner_env()}
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH")])
        )
        return start_child([args[0], "-m", "grpo_core.run.lifeline", "uvicorn", *args[3:]], env=env, **kwargs)

    # Prefect's server module sees this in place of the subprocess module while it starts the server, nothing else
    owned_subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": popen})

    class OwnedASGIServer(prefect_server.SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            with _PATCH_LOCK:
                prefect_server.subprocess = owned_subprocess
                try:
                    return super()._run_uvicorn_command()
                finally:
                    prefect_server.subprocess = subprocess

    return OwnedASGIServer


_PATCH_LOCK = threading.Lock()


def _owned_server() -> Any:
    """The temporary API server object: Prefect keeps one per port (``SubprocessASGIServer._instances``), so the
    flow engine, which asks for ``SubprocessASGIServer()`` itself, finds this one; a plain one made earlier in
    this process and never started is replaced, a started one is kept (with a warning: a Ctrl-C reaches it)."""
    owned = _owned_server_class()
    instances = owned._instances  # noqa: SLF001 - Prefect's registry of servers by port (see above)
    plain = instances.get(None)
    if plain is not None and not isinstance(plain, owned):
        if plain.server_process is None and not plain.running:
            del instances[None]
        else:
            logger.warning(
                "Prefect's temporary API server was started before grpo-flow's: it runs in this "
                "command's process group, so a Ctrl-C reaches it too"
            )
    return owned()


def start_local_api() -> str:
    """Make Prefect's API ready for a flow run in this process; returns its URL.

    With ``PREFECT_API_URL`` set, that server must answer. Otherwise Prefect's temporary server is
    started now (Prefect would start it lazily inside the flow call) in a thread while this one
    watches its process, so a server that exits fails the command at once instead of after
    ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``.

    Raises:
        ConfigError: the home folder or database cannot be used.
        PrefectApiError: the configured server does not answer, or the temporary one exited or timed out.
    """
    if os.environ.get("PREFECT_API_URL"):
        check_api_url(os.environ["PREFECT_API_URL"])
        return os.environ["PREFECT_API_URL"]
    home = prepare_home(Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser())
    auth = _own_auth()
    server = _owned_server()
    failure: list[BaseException] = []

    def start() -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - handed to the watching thread
            failure.append(exc)

    thread = threading.Thread(target=start, name="prefect-api-start", daemon=True)
    thread.start()
    where = f"PREFECT_HOME={home}, database {database_path(home, os.environ)}"
    while thread.is_alive():
        thread.join(0.25)
        process = server.server_process
        code = process.poll() if process is not None else None
        if code is not None and code != 3:  # 3 = port taken: Prefect retries on another port itself
            raise PrefectApiError(
                f"Prefect's temporary API server exited with code {code} while starting ({where}); its output is above"
            )
    if failure:
        raise PrefectApiError(f"Prefect's temporary API server did not start ({where}): {failure[0]}")
    if auth is not None:
        verify_own_server(server.api_url, auth, server.server_process, "this command")
    logger.info("Prefect's temporary API server at %s (%s)", server.api_url, where)
    return server.api_url
