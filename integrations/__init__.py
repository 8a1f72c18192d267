"""Bindings of vecstore to model frameworks.

Nothing is imported here: ``import integrations.hf`` (needs ``vecstore[hf]``) loads the
transformers binding only when asked for.
"""
