# A customer-managed key per region for what fedllm stores there: secrets, disks, the database,
# logs. IAM policies of the account decide who may use it; CloudWatch Logs of this region may
# encrypt its log groups with it.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

data "aws_iam_policy_document" "key" {
  #checkov:skip=CKV_AWS_109:This is a key policy: its resource "*" is the key itself, and the first statement hands control to the account's IAM policies (AWS's default key policy).
  #checkov:skip=CKV_AWS_111:Same key policy: "*" names only this key, and write access is granted to the account (then narrowed by IAM) and to CloudWatch Logs for this account's log groups.
  #checkov:skip=CKV_AWS_356:Same key policy: a key policy's "*" resource cannot be narrowed further, it already means this key.
  statement {
    sid       = "AccountAdministersThroughIam"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
  statement {
    sid = "CloudWatchLogsEncryptsThisAccountsGroups"
    actions = [
      "kms:Encrypt*",
      "kms:Decrypt*",
      "kms:ReEncrypt*",
      "kms:GenerateDataKey*",
      "kms:Describe*",
    ]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${var.region}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${data.aws_partition.current.partition}:logs:${var.region}:${data.aws_caller_identity.current.account_id}:log-group:*"]
    }
  }
}

resource "aws_kms_key" "this" {
  region                  = var.region
  description             = "fedllm ${var.name}"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.key.json
  tags                    = var.tags
}

resource "aws_kms_alias" "this" {
  region        = var.region
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this.key_id
}
