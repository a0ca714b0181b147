def gelu_reference(x):
    return x


def gelu_aot(x):
    return x
