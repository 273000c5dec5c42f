"""``python -m grpo_core.serving.embedded``: runs :func:`grpo_core.serving.embedded.server.main`."""

from grpo_core.serving.embedded.server import main

if __name__ == "__main__":
    main()
