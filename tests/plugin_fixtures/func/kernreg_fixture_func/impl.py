def scale_reference(x, factor=2.0):
    return [v * factor for v in x]


def scale_fast(x, factor=2.0):
    return [v * factor for v in x]
