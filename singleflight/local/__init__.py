"""The lock dir backend: kernel flock, FIFO queue files and records in the lock dir. One host."""
