"""The store catalog: SQLite through SQLAlchemy 2 (tables in :mod:`.schema`)."""

from vecstore.catalog.catalog import Catalog as Catalog
from vecstore.catalog.records import Commit as Commit
from vecstore.catalog.schema import SCHEMA_VERSION as SCHEMA_VERSION

__all__ = ["Catalog", "Commit", "SCHEMA_VERSION"]
