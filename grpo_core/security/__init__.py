"""What keeps a run's code and secrets its own: which code a config may name (``allowlist``), the run's bearer token,
nonces and identity challenge (``auth``), and the secrets of a config kept out of every file, log and command line
(``redact``). README "Security" and docs/security.md say what each guard covers."""
