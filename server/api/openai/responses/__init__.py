"""The OpenAI Responses protocol adapter: ``/v1/responses`` and its stored responses."""
