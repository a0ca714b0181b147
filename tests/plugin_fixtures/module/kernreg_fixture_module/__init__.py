"""A plugin whose entry point names a module that registers on import."""
