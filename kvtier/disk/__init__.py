"""The disk tier: verified, vectored slot reads and writes over one or more paths, and what runs it."""
