"""Engines reached over the network, as the gateway's engine clients: a `loragate engine` over
its WebSocket, engines behind an endpoint picker, and the wire between them and a gateway.
What a `loragate engine` runs is gateway/engine_service/; pools and routing, gateway/models/."""
