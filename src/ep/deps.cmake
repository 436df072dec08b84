set(EPMOE_DEPS core router kernels layer eplb comm)
