"""Core: names, records, files, processes and messages. Imports no backend."""
