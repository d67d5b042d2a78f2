variable "name" {
  description = "Name prefix of every resource (VPC, subnets, gateways, flow-log group)."
  type        = string
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,40}$", var.name))
    error_message = "name: 2-41 characters, lowercase letters, digits and '-', starting with a letter."
  }
}

variable "region" {
  description = "AWS region of the VPC, e.g. us-east-1."
  type        = string
  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "cidr" {
  description = "IPv4 range of the VPC; split into one public (and optionally one private) /20 per zone."
  type        = string
  validation {
    condition     = can(cidrhost(var.cidr, 0)) && can(regex("/(1[0-8]|[0-9])$", var.cidr))
    error_message = "cidr must be an IPv4 CIDR of /18 or larger, e.g. 10.40.0.0/16."
  }
}

variable "availability_zones" {
  description = "Zones to spread the subnets over (names such as us-east-1a); one public subnet each."
  type        = list(string)
  validation {
    condition     = length(var.availability_zones) >= 1 && length(var.availability_zones) <= 4
    error_message = "availability_zones: between 1 and 4 zones."
  }
}

variable "private_subnets" {
  description = "Also create private subnets with a NAT gateway per zone (the gateway's tasks and database live there); their NAT addresses are the VPC's fixed egress IPs."
  type        = bool
}

variable "flow_log_kms_key_arn" {
  description = "KMS key that encrypts the VPC flow-log group."
  type        = string
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:", var.flow_log_kms_key_arn))
    error_message = "flow_log_kms_key_arn must be a KMS key ARN."
  }
}

variable "log_retention_days" {
  description = "Days the VPC flow logs are kept."
  type        = number
  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a CloudWatch Logs retention value (e.g. 30, 90, 365)."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
}
