set(EPMOE_DEPS core kernels layer safetensors)
