"""The only package that imports generated gRPC stubs: server, client, auth, options, serde, link probe."""
