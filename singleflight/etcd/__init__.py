"""The etcd backend: the same lock across hosts, after etcd's own mutex recipe."""
