"""The flush after a transactional test keeps the content types and permissions: the same end
state, without making them again.

Django's flush empties every table and then sends post_migrate, whose receivers make again
what migrating made: a content type for every model and four permissions for each (the
contrib apps' `create_contenttypes`, `create_permissions`: a bulk insert per app). So those two
tables come back as they were, row for row, after every transactional test — made anew, at
0.5 s a test on a loaded two-core machine, ~500 transactional tests per suite. Keeping them
out of the flush leaves post_migrate to find every row in place (a read per app). Every other
table is emptied as before and post_migrate is still sent, so the rest of its receivers run
as they did (the anonymous user, SQLite's step view).

No test makes or deletes a content type or a permission; one that did would see it survive
the flush, as rows of the tables migrations fill survive `TestCase`'s rollback. Installed by
tests/conftest.py, for both databases.
"""

from __future__ import annotations

from typing import Any


def install() -> None:
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management.commands import flush

    full = flush.sql_flush
    if getattr(full, "keeps", None):
        return
    kept = frozenset({ContentType._meta.db_table, Permission._meta.db_table})

    def sql_flush(style: Any, connection: Any, **options: Any) -> list[str]:
        names = connection.introspection.django_table_names
        tables = [t for t in names(only_existing=True, include_views=False) if t not in kept]
        return list(connection.ops.sql_flush(style, tables, **options))

    sql_flush.keeps = kept  # type: ignore[attr-defined]
    flush.sql_flush = sql_flush  # type: ignore[assignment]
