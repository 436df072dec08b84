set(EPMOE_DEPS core eplb trace ep)
