"""The OpenAI Files API (`/v1/files`): a tenant's batch input files, uploaded and checked line by
line against the routes they name, and the files a batch writes, listed, read and deleted."""
