"""The PostgreSQL backend: one database, many hosts (docs/backends.md)."""
