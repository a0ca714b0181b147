def fn(x):
    return x
