// safetensors tests: being written.
