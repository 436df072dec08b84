set(EPMOE_DEPS core router layer trace eplb comm ep rebalance)
