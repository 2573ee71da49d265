"""Spindle model service: the LLM engine (`engine/`, `models/`, `lora/`) and the model pod that
serves it over gRPC (`pod/`). Importing it changes nothing process-wide: an engine process's
settings are made at its start (`startup.configure_process`)."""
