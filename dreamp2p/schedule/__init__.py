"""Pure planning code: cost models and schedules. No asyncio, grpc or torch.distributed here."""
