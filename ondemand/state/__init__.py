"""The SQLite state file: the store and its migrations."""
