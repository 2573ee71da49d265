"""Spindle model service: the LLM engine and (later) its gRPC server."""
