"""What a step costs before it runs: peak bytes, FLOPs from the jaxpr, collectives in the HLO, models of traffic."""
