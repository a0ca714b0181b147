"""A plugin that calls sys.exit when imported."""
