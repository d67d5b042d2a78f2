# One configuration per cloud: AWS 6.x takes the region per resource, Google and Azure per
# resource anyway, so a site map can name any region without new provider blocks. A provider no
# site uses is never configured, so AWS-only deployments need no GCP or Azure credentials.

provider "aws" {
  region = var.gateway.region
}

provider "google" {
  project = var.gcp_project
}

provider "azurerm" {
  subscription_id = var.azure_subscription_id
  features {
    key_vault {
      # Purge protection keeps deleted vaults for their retention period anyway.
      purge_soft_delete_on_destroy = false
    }
  }
}
