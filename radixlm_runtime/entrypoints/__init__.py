"""Ways to run the runtime: the offline Engine in-process (the HTTP server is launch_server)."""
