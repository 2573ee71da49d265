"""Model definitions, the Model/TransformerLayer protocols, and weight loaders."""
