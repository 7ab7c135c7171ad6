// safetensors reader/writer: being written.
