"""Services: the ConversationManager and friends. They depend on core and on ports only."""
