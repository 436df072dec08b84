set(EPMOE_DEPS core router)
