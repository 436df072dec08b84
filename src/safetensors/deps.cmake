set(EPMOE_DEPS core)
