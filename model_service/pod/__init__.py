"""The model pod (`spindle serve`): the engine behind gRPC.

- `server`: flags, start-up order, the two listening ports (serving and control), signals, drain;
- `generation`: the Generation and PodStatus services;
- `control`: the ModelControl service (adapter placement, peer fetch, Drain);
- `state`: what the RPCs share (the engine, through its typed surface `engine.handle.EngineHandle`;
  the requests in flight, the load report);
- `status`: engine errors -> gRPC status codes (the one mapping);
- `wire`: proto messages <-> engine keywords and outputs;
- `metrics`: Prometheus, under vLLM's names.
"""
