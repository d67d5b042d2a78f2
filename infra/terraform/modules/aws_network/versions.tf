terraform {
  required_version = ">= 1.9.0"
  required_providers {
    # 6.x: every regional resource takes a `region` argument, so one provider serves all regions.
    aws = {
      source  = "hashicorp/aws"
      version = ">= 6.6.0, < 7.0.0"
    }
  }
}
