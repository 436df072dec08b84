set(EPMOE_DEPS core eplb comm ep)
