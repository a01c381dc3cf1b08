#!/usr/bin/env python
"""Django's command-line utility for Holdpoint.

For local use it also reads VAR_DIR/local.env (written by `make run`: DEBUG=1 and a
generated SECRET_KEY) for every variable the environment does not set — see
config.env.load_local_env. The web server's entry points (config/wsgi.py, asgi.py) do not:
production takes its settings from the environment alone.
"""

import os
import sys
from pathlib import Path


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from config.env import load_local_env, local_env_path

    load_local_env(local_env_path(Path(__file__).resolve().parent))
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
