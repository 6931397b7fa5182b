"""Framework adapters (LangChain ``ChatAgentSpec``, litellm provider). Imported only on demand."""
