"""The connector's scheduler side: bookkeeping of what each request loads and stores."""
