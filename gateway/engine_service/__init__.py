"""What `loragate engine` runs: one engine served to gateways over a WebSocket and OpenAI routes."""
