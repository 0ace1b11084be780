"""Engines reached over the network: `loragate engine` (one engine as a service), the wire
between it and a gateway, and the gateway's pool of remote replicas with its routing."""
