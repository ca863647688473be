"""Shared by every test under tests/kvpool: this folder is on `sys.path` (pytest puts a
rootless conftest's folder there), so tests import their helpers as `etcd_testing`."""
