"""The vLLM adapter (``kv_connector_module_path = "kvtier.connector"``).

The only part of kvtier that imports vLLM.
"""
