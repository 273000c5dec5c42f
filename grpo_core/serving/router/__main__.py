"""``python -m grpo_core.serving.router``: runs :func:`grpo_core.serving.router.server.main`."""

from grpo_core.serving.router.server import main

if __name__ == "__main__":
    main()
