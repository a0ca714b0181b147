from clifx_pkg.a import fn

__all__ = ["fn"]
