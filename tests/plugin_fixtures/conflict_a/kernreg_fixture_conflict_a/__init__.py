"""One of two plugins that register different kernels for one key."""
