"""`manage.py <command>` with the debug cursor off: the bench's worker processes.

The bench environment sets DEBUG=1 only so the settings load without production secrets
(bench/common.py `bench_env`); a worker with DEBUG on would record every query it sends,
which a production worker does not. So: django.setup(), DEBUG off, then the command —
qcluster forks its workers after this, and they inherit the setting.

    python bench/djrun.py qcluster
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import execute_from_command_line

    settings.DEBUG = False
    execute_from_command_line([str(ROOT / "manage.py"), *sys.argv[1:]])


if __name__ == "__main__":
    main()
