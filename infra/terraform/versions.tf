# Provider versions are pinned to a minor series here; run `terraform init` once and commit the
# generated .terraform.lock.hcl so every apply uses the same provider builds.
terraform {
  # 1.9: variable validations may refer to other variables (a site's model must be in var.models).
  required_version = ">= 1.9.0, < 2.0.0"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 6.6"
    }
    google = {
      source  = "hashicorp/google"
      version = "~> 7.31"
    }
    azurerm = {
      source  = "hashicorp/azurerm"
      version = "~> 4.46"
    }
    random = {
      source  = "hashicorp/random"
      version = "~> 3.7"
    }
    tls = {
      source  = "hashicorp/tls"
      version = "~> 4.1"
    }
  }
}
