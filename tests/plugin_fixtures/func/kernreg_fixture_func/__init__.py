"""A plugin whose entry point names a registration function."""
