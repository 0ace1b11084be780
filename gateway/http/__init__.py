"""HTTP at the edge: the error shape, request bodies, the routes' dependencies, instants."""
