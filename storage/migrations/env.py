"""Alembic environment for the studio schema.

Normally run by ``storage.db.Database.upgrade()``, which passes an open connection
in ``config.attributes["connection"]``. From the command line
(``python -m alembic -c storage/alembic.ini ...``) it opens the database named by
``$TOKENSWIFT_DB`` (default ``data/studio.db``).
"""

from alembic import context

from storage.models import Base


def run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported")

connection = context.config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    from storage.db import Database, resolve_url

    db = Database(resolve_url(context.config.get_main_option("sqlalchemy.url") or None))
    try:
        with db.migration_connection() as conn:
            run(conn)
    finally:
        db.close()
